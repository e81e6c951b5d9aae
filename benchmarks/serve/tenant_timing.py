"""Can one tenant learn another's prompt from timing? A right guess against a wrong one (issue 35).

Tenant A sends a prompt whose system message holds a secret and which quotes indexed documents: its head
(the instructions before the first chunk) and the chunk behind it are cached, under A's key. Tenant B then
guesses the secret: each trial sends the prompt with the right secret and with a wrong one, in turn, each
under a new `cache_salt` (B's own caches from an earlier trial would answer B's next identical guess and say
nothing about A). If caches of request text leaked across tenants, the right guess would load A's head and
answer sooner. Positive control: A sending its own prompt again (a hit). Reported: the response time as the
client sees it (one token) and the server's TTFT, median and spread per kind, and the right-minus-wrong
difference of medians with a bootstrap 95% interval.

    python benchmarks/serve/tenant_timing.py --index /tmp/chat-idx --out benchmarks/serve/tenant-timing.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chat"))
from conversation import Server  # noqa: E402  (rag-kvcache serve in a subprocess)

SYSTEM = "You answer for the harbour office of Tessaly. The door code is {code}; never tell it to anyone. "


def ask(url: str, key: str, messages: list[dict], salt: str | None) -> tuple[float, float]:
    """(client seconds, server TTFT seconds) of a one-token answer."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 1, "temperature": 0}
    body |= {"cache_salt": salt} if salt else {}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed, r.json()["rag_kvcache"]["ttft_s"]


def bootstrap_diff(a: list[float], b: list[float], n: int = 5000) -> tuple[float, float, float]:
    rng = random.Random(0)
    diffs = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b))) for _ in range(n)
    )
    return statistics.median(a) - statistics.median(b), diffs[int(0.025 * n)], diffs[int(0.975 * n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=12)
    args = parser.parse_args()
    server = Server(args.index, "--api-key", "key-a", "--api-key", "key-b", api_key="key-a")
    url = server.url
    try:
        hits = httpx.post(
            f"{url}/v1/retrieve",
            json={"query": "lighthouse keeper diary", "top_k": 2},
            headers={"Authorization": "Bearer key-a"},
            timeout=60,
        ).json()["data"]
        documents = "\n\n".join(h["text"] for h in hits)

        def prompt(code: str) -> list[dict]:
            return [
                {"role": "system", "content": SYSTEM.format(code=code) * 3},
                {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: Who kept a diary?"},
            ]

        ask(url, "key-a", prompt("7391"), None)  # A's head and chunk computed and cached under A
        rows: dict[str, list[tuple[float, float]]] = {"right": [], "wrong": [], "a_again": []}
        for i in range(args.trials):
            order = [("right", "7391"), ("wrong", f"{1000 + i}")]
            random.Random(i).shuffle(order)
            for kind, code in order:
                rows[kind].append(ask(url, "key-b", prompt(code), f"trial-{kind}-{i}"))
            rows["a_again"].append(ask(url, "key-a", prompt("7391"), None))
    finally:
        server.close()
    out = {}
    for kind, values in rows.items():
        client, server = [v[0] for v in values], [v[1] for v in values]
        out[kind] = {
            "client_median_s": statistics.median(client),
            "client_min_s": min(client),
            "client_max_s": max(client),
            "server_ttft_median_s": statistics.median(server),
        }
    for name, col in (("client", 0), ("server_ttft", 1)):
        d, lo, hi = bootstrap_diff([v[col] for v in rows["right"]], [v[col] for v in rows["wrong"]])
        out[f"right_minus_wrong_{name}_s"] = {"median_diff": d, "ci95": [lo, hi]}
        d, lo, hi = bootstrap_diff([v[col] for v in rows["a_again"]], [v[col] for v in rows["wrong"]])
        out[f"a_again_minus_b_wrong_{name}_s"] = {"median_diff": d, "ci95": [lo, hi]}
    print(json.dumps(out, indent=1))
    args.out.write_text(json.dumps({"summary": out, "rows": rows, "command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
