"""A chat that outgrows the server's prompt limit, through `rag-kvcache serve` with the `openai` client: the
turns that drop the oldest messages, with the shortened history prepared while the server was idle
(`FusedGenerator.prepare_fit`), against a server of other code (`--baseline`, a checkout of the code
before it) sent exactly the same messages (issue 36 item 2).

Each turn asks a question with `top_k` chunks retrieved for it (at the head of that turn's message); after
each answer the client waits until the server's background queue is empty (a user reading the answer
and typing the next question), then sends the next turn to both servers, the baseline second.

    python benchmarks/chat/overflow.py --index /tmp/chat-idx --baseline /tmp/wt-old \\
        --max-prompt-tokens 512 --turns 24 --out benchmarks/chat/overflow.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
from conversation import QUESTIONS, Server, build_index


def background_done(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.findall(r'^rag_kvcache_background_tasks_total\{outcome="(?:done|failed)"\} (\S+)$', text, re.MULTILINE)
    return sum(map(float, found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--method", default="cacheblend")
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    if not args.index.exists():
        build_index(args.index)
    limit = ("--max-prompt-tokens", str(args.max_prompt_tokens))
    new, old = Server(args.index, *limit), Server(args.index, *limit, code=args.baseline)
    extra = {"top_k": args.top_k}
    messages: list[dict] = []
    rows = []
    try:
        for i in range(args.turns):
            messages.append({"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i + 1})"})
            n = new.ask(messages, args.method, args.max_tokens, extra)
            deadline = time.monotonic() + 300
            while background_done(new) < i + 1 and time.monotonic() < deadline:  # the user reads and types
                time.sleep(0.1)
            o = old.ask(messages, args.method, args.max_tokens, extra)  # after the new server's work: alone
            rows.append({"turn": i + 1, "new": n, "old": o})
            print(
                f"turn {i + 1:2d}: {n['prompt_tokens']} tokens ({n['dropped_messages']} messages dropped), "
                f"conversation {n['conversation_tokens']} vs {o['conversation_tokens']}; "
                f"TTFT {n['ttft_s'] * 1e3:.0f} vs {o['ttft_s'] * 1e3:.0f} ms",
                flush=True,
            )
            messages.append({"role": "assistant", "content": n["answer"]})
    finally:
        new.close()
        old.close()
    # a cut turn: more of the oldest messages dropped than the turn before
    cut = [r for r, before in zip(rows[1:], rows) if r["new"]["dropped_messages"] != before["new"]["dropped_messages"]]
    summary = {
        "cut_turns": [r["turn"] for r in cut],
        "cut_ttft_ms": {k: [round(r[k]["ttft_s"] * 1e3) for r in cut] for k in ("new", "old")},
        "cut_conversation_tokens": {k: [r[k]["conversation_tokens"] for r in cut] for k in ("new", "old")},
        "other_turns_median_ttft_ms": {
            k: statistics.median(r[k]["ttft_s"] * 1e3 for r in rows[1:] if r not in cut) for k in ("new", "old")
        },
    }
    print(json.dumps(summary))
    args.out.write_text(json.dumps({"summary": summary, "turns": rows, "command": sys.argv}, indent=1) + "\n")


if __name__ == "__main__":
    main()
