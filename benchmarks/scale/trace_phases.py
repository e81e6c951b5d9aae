"""The phases of a `budget_trace.py` stream: median time to the first token per quarter of the stream, the
default's and `full`'s, with 95% bootstrap intervals, and the ratios the trace's targets name (second half over
first half after warm-up; `full` over the default in the second half), beside the same for the last quarter over
the third (after the hot set has filled). With `--ledger`, the byte hit ratio of each quarter of the stream's
chunk-cache reads, from the access log of the store the stream ran on (`index/kv/ledger.sqlite`): whether the
hot set decays. With `--against`, another run of the same stream (same `--seed`, `--draws` and start state, other
code): the mean per-request difference of each timing, paired request by request, with 95% bootstrap intervals.

    python benchmarks/scale/trace_phases.py benchmarks/scale/budget-trace.json [--warmup 100] \
        [--ledger WORK/index/kv/ledger.sqlite [--since TRACE_T0]] [--against OTHER.json]

Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
from collections.abc import Callable
from pathlib import Path


def interval(
    statistic: Callable[..., float], *samples: list[float], draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 95% bootstrap interval of `statistic(*samples)`, each sample resampled independently."""
    rng = random.Random(seed)
    stats = sorted(statistic(*(rng.choices(s, k=len(s)) for s in samples)) for _ in range(draws))
    return stats[int(0.025 * draws)], stats[int(0.975 * draws) - 1]


def median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(num) / statistics.median(den)


def describe(name: str, values: list[float]) -> str:
    lo, hi = interval(statistics.median, values)
    return f"| {name} | {len(values)} | {statistics.median(values):.2f} [{lo:.2f}, {hi:.2f}] s |"


def describe_pair(name: str, rows: list[dict], client: str, server: str) -> str:
    """The medians of two timings of the same requests, and the mean of the client's wait beyond the server's."""
    both = [(r[client], r[server]) for r in rows if client in r]
    wait = statistics.mean(c - s for c, s in both)
    return (
        f"| {name} | {statistics.median(c for c, _ in both):.2f} / {statistics.median(s for _, s in both):.2f} s "
        f"(mean wait {wait:.2f} s, n {len(both)}) |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a budget_trace.py JSON")
    ap.add_argument("--warmup", type=int, default=100, help="requests left out of the first half, as the trace's")
    ap.add_argument("--ledger", type=Path, help="the store's ledger.sqlite, for the byte hit ratio per quarter")
    ap.add_argument(
        "--since", type=float, help="the stream's start (Unix seconds); default: the JSON's `trace_t0`, if recorded"
    )
    ap.add_argument("--against", type=Path, help="another run of the same stream, compared request by request")
    args = ap.parse_args()
    result = json.loads(args.trace.read_text())
    rows = result["rows"]
    n = len(rows)
    quarters = [rows[q * n // 4 : (q + 1) * n // 4] for q in range(4)]

    print("| requests | n | median TTFT [95%] |")
    print("|---|---:|---:|")
    for q, part in enumerate(quarters):
        span = f"{part[0]['i']}-{part[-1]['i']}"
        print(describe(f"default, {span}", [r["ttft_s"] for r in part]))
        if full := [r["full_ttft_s"] for r in part if "full_ttft_s" in r]:  # a short run leaves a quarter without
            print(describe(f"`full`, {span}", full))

    first = [r["ttft_s"] for r in rows[args.warmup : n // 2]]
    second = [r["ttft_s"] for r in rows[n // 2 :]]
    full_second = [r["full_ttft_s"] for r in rows[n // 2 :] if "full_ttft_s" in r]
    third, fourth = ([r["ttft_s"] for r in part] for part in quarters[2:])
    print()
    print("| ratio | value [95%] |")
    print("|---|---:|")
    ratios = [
        (f"second half / first half after {args.warmup}", second, first),
        ("last quarter / third quarter", fourth, third),
        ("`full` / default, second half", full_second, second),
    ]
    timed_by_server = all("server_ttft_s" in r for r in rows)  # from the fusion's start: no wait in the queue
    if timed_by_server:
        server = [r["server_ttft_s"] for r in rows[n // 2 :]]
        full_server = [r["full_server_ttft_s"] for r in rows[n // 2 :] if "full_server_ttft_s" in r]
        ratios.append(("`full` / default, second half, server-timed", full_server, server))
    for name, num, den in ratios:
        lo, hi = interval(median_ratio, num, den)
        print(f"| {name} | {median_ratio(num, den):.2f} [{lo:.2f}, {hi:.2f}] |")
    if timed_by_server:
        for name, client, by_server in (
            ("default", "ttft_s", "server_ttft_s"),
            ("`full`", "full_ttft_s", "full_server_ttft_s"),
        ):
            print(describe_pair(f"{name}, second half: client / server-timed", rows[n // 2 :], client, by_server))
    if args.against is not None:
        print_paired(rows, json.loads(args.against.read_text())["rows"], args.against.name)
    if args.ledger is not None:
        since = args.since if args.since is not None else result.get("trace_t0")
        if since is None:
            ap.error("--ledger needs --since: this JSON does not record its stream's start (`trace_t0`)")
        print_hit_ratios(args.ledger, since)


def print_paired(rows: list[dict], other: list[dict], name: str) -> None:
    """This run's timings minus `other`'s (the same stream), request by request: the mean difference of the client's
    time to the first token, the server's, and the wait between, over the whole stream and its second half. A run
    cut short (its `.partial.json`) is paired with as many of `other`'s first requests."""
    if len(rows) < len(other):
        print(f"\n(this run was cut short: its {len(rows)} requests against the first {len(rows)} of {name})")
        other = other[: len(rows)]
    if [(r["question"], r["wording"]) for r in rows] != [(r["question"], r["wording"]) for r in other]:
        raise SystemExit(f"{name} is not the same stream of questions: the runs cannot be paired")
    n = len(rows)
    print()
    print(f"| this run minus {name}, request by request | requests | mean difference [95%] |")
    print("|---|---:|---:|")
    timings = {
        "client TTFT": lambda r: r["ttft_s"],
        "server-timed TTFT": lambda r: r["server_ttft_s"],
        "wait (client minus server)": lambda r: r["ttft_s"] - r["server_ttft_s"],
    }
    for span, start in (("all", 0), ("second half", n // 2)):
        for what, timing in timings.items():
            diffs = [timing(a) - timing(b) for a, b in zip(rows[start:], other[start:])]
            lo, hi = interval(statistics.mean, diffs)
            print(f"| {what}, {span} | {len(diffs)} | {statistics.mean(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}] s |")


def print_hit_ratios(ledger: Path, since: float) -> None:
    """The byte hit ratio of each quarter of the chunk-cache reads the ledger logged from `since` on."""
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        reads = db.execute("SELECT bytes, hit FROM accesses WHERE t >= ? ORDER BY rowid", (since,)).fetchall()
    if not reads:
        raise SystemExit(f"{ledger} logged no reads from {since} on")
    n = len(reads)
    print()
    print("| quarter of the stream's chunk-cache reads | reads | byte hit ratio |")
    print("|---|---:|---:|")
    for q in range(4):
        part = reads[q * n // 4 : (q + 1) * n // 4]
        print(f"| {q + 1} | {len(part)} | {sum(b * h for b, h in part) / sum(b for b, _ in part):.3f} |")


if __name__ == "__main__":
    main()
