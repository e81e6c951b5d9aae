"""Can an oversized request delay a small one? (issue 35.) A 20 MB chat body was once tokenised whole on the
engine's thread (23-33 s) while a 2-token request waited behind it (27.5 s against 0.9 s alone).

A server (`rag-kvcache serve`, defaults: 16 MiB body limit, 8,192 prompt tokens) answers a small request
(a short question, 2 tokens) alone, then while other clients keep sending, back to back, chat bodies of
15 MB (under the body limit, so parsed, and refused before tokenising by the prompt's character bound) and
of 20 MB (over it: 413 unread). Reported: the small request's response time, median and max over the
trials, alone and under that traffic, and the status codes the oversized requests got.

    python benchmarks/serve/oversized.py --index /tmp/chat-idx --out benchmarks/serve/oversized.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chat"))
from conversation import Server  # noqa: E402  (rag-kvcache serve in a subprocess)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--senders", type=int, default=3)
    args = parser.parse_args()
    server = Server(args.index)
    url = server.url
    small = {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Who kept a diary of ships?"}],
    }
    bodies = {
        size: json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "word " * (size // 5)}],
            }
        ).encode()
        for size in (15_000_000, 20_000_000)
    }
    codes: dict[int, int] = {}
    stop = threading.Event()

    def timed() -> float:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/chat/completions", json=small, timeout=300)
        r.raise_for_status()
        return time.perf_counter() - t0

    def flood(size: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                r = client.post(
                    f"{url}/v1/chat/completions", content=bodies[size], headers={"Content-Type": "application/json"}
                )
                codes[r.status_code] = codes.get(r.status_code, 0) + 1

    try:
        timed()  # warm up
        alone = [timed() for _ in range(args.trials)]
        senders = [
            threading.Thread(target=flood, args=(size,))
            for size in (15_000_000, 20_000_000)
            for _ in range(args.senders)
        ]
        for t in senders:
            t.start()
        time.sleep(2)
        loaded = [timed() for _ in range(args.trials)]
        stop.set()
        for t in senders:
            t.join()
    finally:
        server.close()
    out = {
        "alone_median_s": statistics.median(alone),
        "alone_max_s": max(alone),
        "with_oversized_median_s": statistics.median(loaded),
        "with_oversized_max_s": max(loaded),
        "median_factor": statistics.median(loaded) / statistics.median(alone),
        "oversized_status_codes": codes,
    }
    print(json.dumps(out, indent=1))
    args.out.write_text(
        json.dumps({"summary": out, "alone_s": alone, "with_oversized_s": loaded, "command": sys.argv}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
